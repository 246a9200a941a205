"""Building a cache: sources → decode, orient, pre-resize → a format's writer, through staging and a
journal; verification and staleness checks of a finished cache."""
