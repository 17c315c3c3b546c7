"""Products known to be symmetric, from the tiles on and above the diagonal: the registry
(``api.py``) and the Pallas Mosaic GPU kernel (``mosaic.py``)."""
