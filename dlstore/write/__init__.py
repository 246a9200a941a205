"""Writing a cache (``dlstore.convert``): sources → decode, orient, pre-resize → a format's writer,
through staging and a journal; publishing to an object store; verification of a finished cache."""
