"""Everything that touches PostgreSQL: the embedded server, connections,
migrations, and one repository module per table family. All SQL the bus runs
is in this package, as constant, parameterized statements."""
