"""LLM applications as dataflow (Parrot's semantic variables): semantic-function templates, declarative output transforms, and (to come) the server-side DAG of calls."""
