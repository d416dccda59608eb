"""Models run in this process: the sentence-transformers host, its int8 ONNX copy, local embeddings."""
