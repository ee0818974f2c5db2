"""Registry of passes: recipe name -> class. Adding a method is one file plus one line here."""

from .awq import AWQ
from .base import LayerPass, RecipeError
from .gptq import GPTQ
from .magnitude import Magnitude
from .rtn import RTN
from .sparsegpt import SparseGPT
from .wanda import Wanda

REGISTRY: dict[str, type[LayerPass]] = {cls.name: cls for cls in (RTN, GPTQ, AWQ, Magnitude, Wanda, SparseGPT)}

__all__ = ["REGISTRY", "LayerPass", "RecipeError"]
