"""Grammar benchmarks: `jsonschema` (JSONSchemaBench coverage, compile time, mask time, generation),
`testsuite` (the official JSON-Schema-Test-Suite), `cfg` (a Lark or GBNF grammar's samples,
parsed by the lark package), with their shared `data` loading, `generate` helpers and `report`
tables. The data folder is named by a flag or an environment variable; the product never depends
on it."""
