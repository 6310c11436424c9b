"""Planning and measuring: the roofline, the planning arithmetic and the hardware table/probe."""
