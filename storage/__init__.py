"""Everything that touches PostgreSQL: connections and pools, migrations, and one
repository module per table family. All SQL the bus runs is in this package, as
constant, parameterized statements. (The embedded server the CLI and the tests
start is `bus.server`.)"""
