"""The request pipeline every route shares: a plan's engine requests submitted and run
(`run.Run`), each candidate's stream of deltas (`candidates`), and a reply's items as they grow
(`reply_items`: Messages' and Responses' message and calls)."""
