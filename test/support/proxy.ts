/**
 * A TCP proxy in front of the test database, for tests that delay, freeze or cut what travels between a
 * client and PostgreSQL. `handle` gets each client's socket and `open`, which connects to PostgreSQL for it;
 * `sockets` holds every socket of the proxy still open, and all of them are destroyed, and the proxy closed,
 * by the test's cleanups. Returns the database URL through the proxy.
 */
import net from "node:net";

export async function startProxy(
  databaseUrl: string,
  cleanups: Array<() => Promise<unknown>>,
  handle: (inbound: net.Socket, open: () => net.Socket) => void,
): Promise<{ url: string; sockets: Set<net.Socket> }> {
  const target = new URL(databaseUrl);
  const sockets = new Set<net.Socket>();
  const track = (socket: net.Socket) => {
    sockets.add(socket);
    socket.on("close", () => sockets.delete(socket));
    return socket;
  };
  const proxy = net.createServer((inbound) =>
    handle(track(inbound), () => track(net.connect(Number(target.port), target.hostname))),
  );
  await new Promise<void>((resolve) => proxy.listen(0, "127.0.0.1", resolve));
  cleanups.push(async () => {
    for (const socket of sockets) socket.destroy();
    await new Promise((resolve) => proxy.close(resolve));
  });
  const url = new URL(databaseUrl);
  url.hostname = "127.0.0.1";
  url.port = String((proxy.address() as net.AddressInfo).port);
  return { url: url.toString(), sockets };
}
