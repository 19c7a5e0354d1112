"""Schema documents before lowering: ``$id``/``$anchor`` registries and ``$ref`` resolution, keyword
value checks, and the structural keys that let identical subschemas share one rule."""
