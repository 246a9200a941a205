"""The worker-process engines the read side runs over a format reader's primitives (``load_unit``,
``decode_unit_into``): ``workers``, fresh interpreters sharing one block of memory with their parent;
``batch_procs``, whole batches decoded straight into a shared-memory ring (``Cache.read_batches``) and
``ReaderEngines``, which starts and stops them for one open cache. ``dlstore.formats`` imports none."""
