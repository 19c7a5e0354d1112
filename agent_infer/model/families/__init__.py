"""Architecture families, one module each over the shared layers; :mod:`agent_infer.model.registry` maps
checkpoint architecture names onto them."""
