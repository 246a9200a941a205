"""The worker-process engines the read side runs over a format reader's primitives.

- ``workers``: fresh interpreters sharing one block of memory with the process that starts them.
- ``batch_procs``: whole batches decoded straight into a shared-memory ring (``Cache.read_batches``).
- ``owner``: ``ReaderEngines``, which starts and stops them for one open cache.

A format's reader only knows its primitives (``load_unit``, ``decode_unit_into``, its unit layout);
these modules start the processes that call them. Nothing here is imported by ``dlstore.formats``.
"""
