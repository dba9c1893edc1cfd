"""mmadapt: mini-model adaptation of masked language models to new languages.

Reference: Marchisio, Lewis, Chen, Artetxe. "Mini-Model Adaptation: Efficiently
Extending Pretrained Models to New Languages via Aligned Shallow Training" (ACL
Findings 2023).
"""

__version__ = "0.1.0"
