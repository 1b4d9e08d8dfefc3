"""``commfuse inspect``: a debug dump as one HTML page (``page``) and a Chrome trace
(``run``), read by ``dump``."""
