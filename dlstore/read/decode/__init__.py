"""The decode lanes of ``dlstore.Loader``'s decode path: ``lanes`` (``DecodePath``, nvJPEG), ``cpu_lane``
(CPU worker processes), ``hw_lane`` (hardware JPEG engines) and ``split`` (each lane's part of a batch)."""
