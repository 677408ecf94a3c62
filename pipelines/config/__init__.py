"""What a job is: the schema (:mod:`.schema`), Hydra's composition (:mod:`.compose`), the cross-field rules
(:mod:`.rules`) and the one validation pass (:mod:`.validate`), the tuned rates (:mod:`.tuned_rates`), a run's
identity (:mod:`.identity`), the verbs' task grids (:mod:`.grids`) and W&B access (:mod:`.wandb_access`).
The lowest layer of ``pipelines/`` (docs/ARCHITECTURE.md): it imports no other layer, and no torch."""
