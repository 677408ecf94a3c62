"""How a job runs: the run store (:mod:`.store`), the runner (:mod:`.runner`), the launchers (:mod:`.launch`,
:mod:`.worker`) and W&B (:mod:`.wandb_log`, :mod:`.wandb_sync`). Imports only :mod:`pipelines.config` below it
(docs/ARCHITECTURE.md)."""
