"""Model code: configs, the Llama family, paged attention, weight loading, fetching."""
