"""The error types moved to :mod:`stallfree.errors` (every package raises them, storage included).

This name stays importable for code written against it: it is the same module object, so
``isinstance`` checks and pickled errors keep working across both names."""

import sys

from stallfree import errors as _errors

sys.modules[__name__] = _errors
