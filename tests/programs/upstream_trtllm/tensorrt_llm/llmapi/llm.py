"""The LLM API: ``LLM.__init__`` builds the executor (``_build_model`` →
``GenerationExecutor.create``); ``generate``, ``generate_async``; ``shutdown``."""
from dataclasses import dataclass, field
from typing import List, Optional

from .._release import stop
from ..executor import GenerationExecutor
from .mpi_session import MpiSession


@dataclass
class CompletionOutput:
    index: int
    text: str


@dataclass
class RequestOutput:
    prompt: str
    outputs: List[CompletionOutput] = field(default_factory=list)


class BaseLLM:

    def __init__(self,
                 model: str,
                 tensor_parallel_size: int = 1,
                 mpi_session: Optional[MpiSession] = None,
                 **kwargs):
        self.model = model
        self.tensor_parallel_size = tensor_parallel_size
        self.mpi_session = mpi_session
        self._executor = None
        self._build_model()

    def _build_model(self):
        self._executor = GenerationExecutor.create(
            engine=self.model,
            model_world_size=self.tensor_parallel_size,
            mpi_session=self.mpi_session,
        )

    def generate(self, inputs):
        single = isinstance(inputs, str)
        prompts = [inputs] if single else list(inputs)
        results = [self._executor.generate_async(p) for p in prompts]
        outputs = [
            RequestOutput(p, [CompletionOutput(0, r.result().text)])
            for p, r in zip(prompts, results)
        ]
        return outputs[0] if single else outputs

    def generate_async(self, prompt: str):
        """One request; ``await .aresult()`` (or ``.result()``) gives its response."""
        return self._executor.generate_async(prompt)

    def shutdown(self):
        if self._executor is not None:
            stop(self._executor)
            self._executor = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()
        return False


class LLM(BaseLLM):

    def __init__(self, model: str, **kwargs):
        super().__init__(model, **kwargs)
