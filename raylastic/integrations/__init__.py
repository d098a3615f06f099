"""Elastic runs of the trainers people already use, resized in place.

``raylastic.integrations.transformers.prepare_trainer(trainer)`` and
``raylastic.integrations.lightning.prepare_trainer(trainer)`` make a Hugging Face
``Trainer`` or a Lightning ``Trainer``, built as usual inside a raylastic train function,
survive node losses and scale-ups without restarting: survivors keep their processes and
their model, the state comes back from peer memory (``ElasticState``), the global batch
stays constant (gradient accumulation follows the world size) and every sample is trained
once per epoch. See docs/integrations.md.

The submodules import their framework lazily-by-import: ``import
raylastic.integrations.transformers`` needs ``transformers`` and ``accelerate`` installed
(``pip install raylastic[hf]``), ``raylastic.integrations.lightning`` needs ``lightning``.
"""
