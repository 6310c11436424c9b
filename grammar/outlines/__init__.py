"""The outlines-core engine: `row` walks outlines-core's token index for one sequence;
`lowering` turns a constraint into the regex outlines-core compiles, through the JSON Schema
lowering in `schema_regex/`."""
