"""Block formats and model files: the GGML block types with their reference codecs (q4_0, q8_0)
and GGUF reading. Built on core."""
