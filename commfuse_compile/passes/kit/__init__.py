"""What a site kind builds with: the ``SiteKind`` interface and a site's base
(``site_kind``, ``site``), the matmuls a collected tensor feeds (``uses``), the blocks
of a product and the paths to them (``blocks``, ``paths``), a product summed by blocks
(``reduced``, ``all_reduce``), the ring core (``ring``), and emitting a rewrite's nodes
(``rewrite``, ``emit``, ``placement``)."""
