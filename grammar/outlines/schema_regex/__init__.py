"""JSON Schema -> regex, for outlines-core: `json_schema` walks the schema (the one `_Lowerer`),
`objects` and `unions` lower objects/arrays and anyOf/oneOf/not through the `lowerer.Lowerer`
protocol, `merge` merges subschemas, `regex_parts` and `regex_pattern` build the regex text."""
