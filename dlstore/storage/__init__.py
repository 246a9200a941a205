"""The ground floor both sides stand on: where a cache lives (a local folder or an fsspec URL,
``stores``), the manifest fetch and the read-through chunk cache of a remote cache (``mirror``).
Nothing here knows a format, a conversion or a reader."""
