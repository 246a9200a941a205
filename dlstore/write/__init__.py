"""Writing a cache: sources → decode, orient, pre-resize → a format's writer, through staging and a
journal; publishing to an object store; verification and staleness checks of a finished cache.

The public function is ``dlstore.convert`` (``dlstore.write.conversion.convert``)::

    from dlstore import ConvertOptions, convert
    convert(SOURCE, DEST, ConvertOptions(size=64))
"""
