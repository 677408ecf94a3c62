"""The pipelines: one command, ``python -m pipelines <verb>`` (:mod:`pipelines.__main__`), over library modules.

No module of the package is a command of its own: ``python -m pipelines.grid table2`` (an old command line,
or an old job file) would import the module and exit 0 having done nothing. Python imports this package
before it runs such a module, so :func:`refuse_module_command` answers there, before any heavy import:
one line ``error: ... use: python -m pipelines <verb> …`` on stderr, exit code 2.
"""
from __future__ import annotations

import sys


def module_command(argv: list[str]) -> str | None:
    """The module the interpreter command line ``argv`` (:data:`sys.orig_argv`) runs with ``-m``, or None
    (a script, ``-c``, the REPL). Short options may be joined (``-Im mod``, ``-mmod``); ``-W``, ``-X`` and
    ``--check-hash-based-pycs`` take a value."""
    words = iter(argv[1:])
    for word in words:
        if word == "--check-hash-based-pycs":
            next(words, None)
        elif not word.startswith("-") or word == "-":
            return None  # a script or stdin: the options end here
        elif not word.startswith("--"):
            for i, flag in enumerate(word[1:], 2):
                if flag == "m":
                    return word[i:] or next(words, None)
                if flag == "c":
                    return None
                if flag in "WX":  # the rest of the word, or the next word, is its value
                    if i == len(word):
                        next(words, None)
                    break
    return None


def refuse_module_command(module: str | None) -> None:
    """Exit 2 with the verb to use instead when ``module`` is a module of this package other than
    ``pipelines`` itself (``pipelines.__main__``), a layer's module included (``pipelines.verbs.run``); the verb of a
    module is the one :data:`pipelines.__main__.VERBS` maps to a function of it (``pipelines.grid``, a verb's
    module before ``pipelines/verbs/`` held it: that verb's)."""
    if module is None or not module.startswith(f"{__name__}.") or module == f"{__name__}.__main__":
        return
    from pipelines.__main__ import VERBS

    old = f"{__name__}.verbs.{module.removeprefix(f'{__name__}.')}"  # pipelines.grid: the verbs' module before the layers
    verb = next((v for v, (target, _) in VERBS.items() if target.split(":")[0] in (module, old)), None)
    use = (f"python -m {__name__} {verb} … (python -m {__name__} {verb} --help)" if verb
           else f"python -m {__name__} <verb> … (python -m {__name__} --help lists the verbs)")
    print(f"error: python -m {module} is not a command; use: {use}", file=sys.stderr)
    sys.exit(2)


refuse_module_command(module_command(sys.orig_argv))
