"""The lowering of each instance type: strings (JSON encoding, patterns, formats, lengths), numbers
(bounds, multiples), objects (members, property order) and arrays."""
