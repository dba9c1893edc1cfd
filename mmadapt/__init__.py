"""mmadapt: mini-model adaptation of masked language models to new languages.

Reference: Marchisio, Lewis, Chen, Artetxe. "Mini-Model Adaptation: Efficiently
Extending Pretrained Models to New Languages via Aligned Shallow Training" (ACL
Findings 2023).
"""

from mmadapt import quiet

__version__ = "0.1.0"

# Before any submodule imports megatron-core, DeepSpeed or torch.distributed: they warn on import.
quiet.install()
