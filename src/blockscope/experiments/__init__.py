"""One module per command's measurement: pure functions `(model, inputs, options) ->
DataFrame(s)` that never print or touch paths."""
