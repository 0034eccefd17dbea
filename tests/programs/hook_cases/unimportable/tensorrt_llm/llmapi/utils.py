raise ImportError("tensorrt_llm bindings are not built for this Python")
