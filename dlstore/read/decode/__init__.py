"""The decode lanes of ``dlstore.Loader``'s decode path (JPEG and ragged caches).

- ``lanes``: ``DecodePath``, the read-ahead and decode threads, nvJPEG, and the batch handed to the crop.
- ``cpu_lane``: CPU worker processes decoding each batch's CPU share into shared-memory slots.
- ``hw_lane``: the GPU's hardware JPEG engines through nvImageCodec.
- ``split``: ``LaneSplit``, how many images of each batch each lane decodes.
"""
