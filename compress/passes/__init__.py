"""Registry of passes: recipe name -> class. Adding a method is one file plus one line here."""

from .activations import Activations
from .awq import AWQ
from .base import LayerPass, ModelPass, PrunePass, RecipeError, WeightQuantPass, gguf_scheme, gguf_schemes
from .blockwise import Blockwise
from .distill import Distill
from .eagle import Eagle
from .gptq import GPTQ
from .kv_cache import KVCachePass
from .kv_fp8 import KVFP8
from .lorc import LoRC
from .lowrank import LowRank
from .magnitude import Magnitude
from .qlora import QLoRA
from .rotate import Rotate
from .rtn import RTN
from .smoothquant import SmoothQuant
from .sparsegpt import SparseGPT
from .wanda import Wanda

PASSES = (
    Rotate,
    RTN,
    GPTQ,
    AWQ,
    Magnitude,
    Wanda,
    SparseGPT,
    LowRank,
    LoRC,
    SmoothQuant,
    Activations,
    KVCachePass,
    KVFP8,
    Blockwise,
    Distill,
    QLoRA,
    Eagle,
)
REGISTRY: dict[str, type[LayerPass]] = {cls.name: cls for cls in PASSES}

__all__ = [
    "REGISTRY",
    "LayerPass",
    "ModelPass",
    "PrunePass",
    "RecipeError",
    "WeightQuantPass",
    "gguf_scheme",
    "gguf_schemes",
]
