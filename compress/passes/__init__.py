"""Registry of passes: recipe name -> class. Adding a method is one file plus one line here."""

from .base import LayerPass, RecipeError
from .awq import AWQ
from .gptq import GPTQ
from .rtn import RTN

REGISTRY: dict[str, type[LayerPass]] = {cls.name: cls for cls in (RTN, GPTQ, AWQ)}

__all__ = ["REGISTRY", "LayerPass", "RecipeError"]
