"""Training on local ranks with and without the pass: the front ends' models (``fronts``),
the loop (``loop``) and what the torchrun examples share (``examples``)."""
