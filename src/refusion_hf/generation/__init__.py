from .refusion_generation_config import RefusionGenerationConfig, RefusionGenerationOutput
from .refusion_generation_mixin import RefusionGenerationMixin

__all__ = ["RefusionGenerationConfig", "RefusionGenerationMixin", "RefusionGenerationOutput"]
