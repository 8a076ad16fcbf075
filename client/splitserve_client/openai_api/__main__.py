from splitserve_client.openai_api.server import main

main()
