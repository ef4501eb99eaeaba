"""Adapters to training frameworks, imported on demand and never by the core package.

- :mod:`batchpilot.integrations.hf`: ``AdaptiveBatchSizeTrainer``, a ``transformers.Trainer`` whose global
  batch size follows a batchpilot controller (seed 003's API); needs ``pip install -e ".[hf]"``.
- :mod:`batchpilot.integrations.lightning`: ``AdaptiveBatchSize``, a ``lightning.Callback`` that does the
  same in a ``lightning.Trainer`` fit; needs ``pip install -e ".[lightning]"``.

Importing this package imports neither framework; each submodule raises an ``ImportError`` that names the
extra to install when its framework is missing.
"""

__all__: list[str] = []
