"""Property names: "any key but these names" as tries shared across objects, ``propertyNames``
automata, and declared names quoted with their colon."""
