"""The SQL layer: everything that touches PostgreSQL, and nothing else.

Connections and pools (`connections`, `lender`, `codecs`), the schema's
versioned migrations (`migrate`, `migrations/`), and one repository module per
table family (`messages`, `topics`, `groups`, `membership`, `leases`,
`queues`, `eventstore`, `workflows`, ...). Every statement the bus runs is a
named constant here, run with parameters; the names that reach SQL are
validated in `names`. The package imports nothing of `bus` or `actors`: the
errors every layer raises (`errors`) and the library's logging (`logs`) live
here because this is the bottom layer.
"""
