"""Many runs compared: ``compare``, ``sweep``, ``frontier`` and the internet time model."""
