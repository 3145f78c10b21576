"""KV-cache compression policies: pure tensor code shared by the embedded engine and the SGLang plugin.

No engine imports here on purpose. Entry points: `KVCompressionConfig` (settings and the shared
trigger rule `should_compress`), `build_compressor(cfg)` -> `KVCompressor.select(...)`.
"""

from sparserl_mcore.rollout.kvcompress.config import METHODS, KVCompressionConfig
from sparserl_mcore.rollout.kvcompress.policies import COMPRESSORS, KVCompressor, build_compressor
from sparserl_mcore.rollout.kvcompress.scoring import attention_mass

__all__ = [
    "COMPRESSORS",
    "METHODS",
    "KVCompressionConfig",
    "KVCompressor",
    "attention_mass",
    "build_compressor",
]
