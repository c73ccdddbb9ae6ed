"""Stream heads: configuration, modules, and the checkpoint folder format."""

from .config import ARCHITECTURES, HeadConfig
from .io import backbone_fingerprint, load_heads, new_heads, output_weight, save_heads
from .modules import HydraBlock, ResidualBlock, StreamHeads

__all__ = [
    "ARCHITECTURES",
    "HeadConfig",
    "HydraBlock",
    "ResidualBlock",
    "StreamHeads",
    "backbone_fingerprint",
    "load_heads",
    "new_heads",
    "output_weight",
    "save_heads",
]
