from .executor import GenerationExecutor, GenerationRequest, GenerationResult

__all__ = ["GenerationExecutor", "GenerationRequest", "GenerationResult"]
