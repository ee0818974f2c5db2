import os as _os

# Whether the user chose where torch.compile caches its code: loading a transformers model sets
# this variable to torch's default, so the decode engine must know before that happens.
USER_INDUCTOR_CACHE = "TORCHINDUCTOR_CACHE_DIR" in _os.environ
