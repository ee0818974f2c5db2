"""What is on disk: one module per format, each writing and reading the declared states
(``compress/state.py``) it stores.

- ``safetensors``: the one safetensors reader (``Checkpoint``) and the streaming shard writer;
- ``compressed_tensors``: integer weights and activation schemes as transformers and vLLM load them;
- ``bitsandbytes``: 4-bit NF4/FP4 codes as transformers saves a ``load_in_4bit`` model;
- ``peft_adapter``: LoRA corrections as a PEFT adapter;
- ``gguf``: llama.cpp's files, written from an export.
"""
