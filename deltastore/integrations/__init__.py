"""Trainer integrations: deltastore as the weight-sync backend of RL training frameworks.

Each module adapts one framework's plug-in point to a :class:`~deltastore.Publisher` on the
trainer side and vLLM's ``"deltastore"`` weight-transfer backend
(:mod:`deltastore.engines.vllm_transfer`) on the rollout servers, without importing the
framework itself: :mod:`deltastore.integrations.trl` (TRL's ``AsyncGRPOTrainer``
``weight_transfer=``). docs/integrations.md has the recipes.

Layering: integrations may import :mod:`deltastore.engines` and everything below it; nothing
in the library imports integrations (the CLI may).
"""
