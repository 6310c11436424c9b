"""The llguidance engine: `engine` compiles a constraint to an llguidance matcher and fills the
token mask; `schema` rewrites a JSON Schema into what llguidance accepts (with `negation`,
`distinct_items`), `order` pins property order where the schema asks for it."""
