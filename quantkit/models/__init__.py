"""Model families (one registry entry each) and the decoder built from config.json."""
