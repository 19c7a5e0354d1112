"""Front ends: each lowers one constraint language to the grammar IR."""
