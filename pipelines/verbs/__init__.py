"""One module per verb of ``python -m pipelines <verb>`` (:data:`pipelines.__main__.VERBS`). A verb imports the
three layers below it, never another verb (docs/ARCHITECTURE.md)."""
