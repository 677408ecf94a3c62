"""``python -m pipelines.aggregate experiment=tableN ...`` (see :mod:`pipelines.aggregate`)."""
import sys

from pipelines.aggregate.cli import main

sys.exit(main())
