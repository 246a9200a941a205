"""One lock around numpy's .npy header parsing where reader threads run it at once.

numpy reads a header with ``ast.literal_eval``; on CPython 3.11 two threads parsing at once can fail with
"SystemError: AST constructor recursion depth mismatch" (python/cpython#106905), seen here as a flaky
failure of the test suite reading npz shards in the reader's threads. A header is a few hundred bytes:
holding a lock while it is parsed costs nothing next to the read.
"""

from __future__ import annotations

import threading

NPY_HEADERS = threading.Lock()
